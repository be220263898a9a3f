"""Upstream adapters: what each inference server's routes mean, as data.

No module outside this package names a product. The proxy asks an adapter to classify a
request and to read what it needs from a body; everything product-specific stays here.

The package imports nothing itself, so a pure rule can import `routes` (the route table,
classification and `RouteRules`) without the HTTP client and trio that `actions`,
`residency` and the products' modules need. `base` holds `Adapter`; `registry` finds one
by name (`adapter_for`).
"""
