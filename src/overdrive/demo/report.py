"""The demo's result table: :class:`overdrive._utils.table.Table` (it moved there so that technique
packages can return tables without importing the demo)."""

from overdrive._utils.table import Table

__all__ = ["Table"]
