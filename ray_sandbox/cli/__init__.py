"""The ``ray-sandbox`` command line."""
