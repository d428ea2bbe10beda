"""Reading allocsampler datasets and finding memory problems in them."""
