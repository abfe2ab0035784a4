"""``python -m subnetdp.core.config``: print the README's configuration table."""

from subnetdp.core.config.docs import key_table

print(key_table())
