"""The SWA-aware radix prefix cache: the tree (cache.py, node.py) and its parts (retention.py, eviction.py;
the tier's Demoter is engine/kvcache/tier/demotion.py)."""
