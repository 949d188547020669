"""Fixtures for the agent tests."""
