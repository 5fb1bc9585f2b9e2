"""_publish: internal package."""
