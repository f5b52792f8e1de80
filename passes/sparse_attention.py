"""`sparse_attention`: Top-k mask or `kv[idx]` gather followed by attention -> attention that reads K/V rows by index.

The matcher for this family has not landed yet: the pass is registered (so flags, the report and the
cache key already know it) and matches nothing; the report says so.
"""

NAME = "sparse_attention"
IMPLEMENTED = False
