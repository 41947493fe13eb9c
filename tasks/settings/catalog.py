"""The catalog settings of one host: ``catalog_overrides``, ``mirror_profile``/``mirror_urls`` and
the artifact names (``model_artifact``, ``dataset_artifact``), checked against files/catalog.toml
(``tasks.catalog``). Checkers in ``tasks.settings``' form: ``check(host, *values)``, raising
``SettingsError``; ``load_settings`` runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.catalog import Catalog, CatalogError, MirrorSet
from tasks.settings.errors import SettingsError


def _catalog(host: str, base: Catalog, overrides: Any) -> Catalog:
    if not isinstance(overrides, Mapping):
        raise SettingsError(host, "catalog_overrides", f"{overrides!r} is not a mapping",
                            "use {artifact: {field: value}}")
    try:
        return base.with_overrides(overrides)
    except CatalogError as exc:
        raise SettingsError(host, "catalog_overrides", str(exc),
                            "name a catalog artifact and one of its overridable fields") from None


def _mirrors(host: str, cat: Catalog, profile: Any, urls: Any) -> MirrorSet:
    if not isinstance(urls, Mapping):
        raise SettingsError(host, "mirror_urls", f"{urls!r} is not a mapping", "use {source: base URL}")
    try:
        return cat.mirrors(profile, urls)
    except CatalogError as exc:
        key = "mirror_profile" if "profile" in str(exc) else "mirror_urls"
        fix = (f"set mirror_profile to one of {', '.join(cat.profiles)}" if key == "mirror_profile"
               else "give an http(s) base URL for a source listed in files/catalog.toml [sources]")
        raise SettingsError(host, key, str(exc), fix) from None


def _artifact_name(host: str, cat: Catalog, key: str, name: Any) -> str:
    try:
        cat.artifact(name)
    except CatalogError as exc:
        raise SettingsError(host, key, str(exc), "name an artifact of files/catalog.toml") from None
    return name
