"""``qckpt search``: a candidate scheme per linear under a size budget, by measured sensitivity."""
