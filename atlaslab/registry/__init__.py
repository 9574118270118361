"""Component registries, structured configs and validation, and what a part declares about its parameters
(:mod:`.weight_decay`: which ones the optimizer must not decay)."""
from atlaslab.registry.config import (build_part, check_choice, check_range, local_path, resolve_part, to_container,
                                      validate_structured)
from atlaslab.registry.errors import ConfigError
from atlaslab.registry.registry import (KINDS, REGISTRIES, Entry, PartConfig, Registry, get_registry,
                                        import_user_modules, list_parts, register)

__all__ = [
    "ConfigError", "Entry", "KINDS", "PartConfig", "REGISTRIES", "Registry", "build_part", "check_choice",
    "check_range", "get_registry", "import_user_modules", "local_path", "list_parts", "register", "resolve_part", "to_container", "validate_structured",
]
