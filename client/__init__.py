"""dflash-loader client side: the iterator trainer processes use (no pyarrow, no planner)."""
