"""What the user sees of results: the live view of a run, its tables and the HTML report.

``autotune.report`` is both this package and the library's :func:`autotune.api.report`:
importing a module of the package makes the name ``autotune.report`` the package, so the
package is callable and calls the function (``autotune.report("report.html")``).
"""

import sys
import types
from typing import Any


class _Package(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from autotune.api import report

        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _Package
