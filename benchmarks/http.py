"""The HTTP endpoint under load (`_http_load.py` says what it measures and prints):

    python benchmarks/http.py [--clients 8] [--seconds 20] [--scheduler slicesched] [--scenario FILE] [--record]

Python puts this folder first on sys.path for every script in it, so this file's name shadows
the standard library's `http` for all of them (torch and urllib import `http.client`). Imported
under that name, it therefore stands in for the standard library's package: it runs that
package's `__init__` and lends it its folder, so `http.client` and the rest load as usual.
"""

import os
import sysconfig

if __name__ == "http":  # imported in place of the standard library's package: be it
    __path__ = [os.path.join(sysconfig.get_paths()["stdlib"], "http")]
    with open(os.path.join(__path__[0], "__init__.py"), encoding="utf-8") as _f:
        exec(compile(_f.read(), _f.name, "exec"))  # noqa: S102 - the standard library's own code
elif __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("http")
    from _http_load import main

    main()
