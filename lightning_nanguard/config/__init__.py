"""One configuration type per callback: each callback's arguments declared once (default, rule, documentation),
validated once at construction, and read from there by the callback and the engine. The docs site's argument
tables are generated from these declarations (tools/docs_site.py)."""

from lightning_nanguard.config._declare import CallbackConfig, argument_rows
from lightning_nanguard.config.grad_norm_monitor import GradNormMonitorConfig

__all__ = ["CallbackConfig", "GradNormMonitorConfig", "argument_rows"]
