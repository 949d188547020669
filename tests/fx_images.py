"""Fixtures for the images tests."""
