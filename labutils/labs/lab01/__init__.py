"""Lab 01, mixed precision: number formats, where AMP's memory goes, each precision timed once."""
