"""_consume: internal package."""
