"""The Tinker-compatible training service (`furlong serve`)."""
