"""Command-line tools beside serving (`jaxserve shard-plan`)."""
