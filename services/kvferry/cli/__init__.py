"""The ``kvferry`` command."""
