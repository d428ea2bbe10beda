"""C source of the LD_PRELOAD sampling shim, shipped as package data."""
