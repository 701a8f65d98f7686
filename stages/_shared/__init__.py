"""Parts every stage shares: argument checks, cut points, replace-by-id, decision records."""
