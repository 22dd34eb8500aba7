"""One module per path a collective can take."""
