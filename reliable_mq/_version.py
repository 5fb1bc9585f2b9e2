"""The package's version, in a module of its own so that any module can import it.

The package root re-exports it as ``reliable_mq.__version__``; modules inside the
package import it from here, never from the root (which imports them).
"""

from __future__ import annotations

__all__ = ("__version__",)

__version__ = "0.1.0"
