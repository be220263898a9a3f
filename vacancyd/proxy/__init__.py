"""The gated reverse proxy: one listener per [[upstream]]."""
