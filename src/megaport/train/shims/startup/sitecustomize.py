"""Start-up of a baseline process (this folder is first on its PYTHONPATH): install the shims
``$MEGAPORT_BASELINE_SHIMS`` names, and report at exit whether any port code was loaded."""

import atexit

from megaport.train.shims import audit, registry

registry.install_from_environment()
atexit.register(audit.report_port_code)
