"""Publishing increments to inference and subscribing to them."""
