"""Fixtures for the network tests."""
