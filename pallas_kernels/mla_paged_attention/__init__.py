"""Paged multi-head latent attention (MLA, DeepSeek V2/V3) over a cache of latent rows."""
