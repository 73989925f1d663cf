"""The rule engine: rules are data (rules/*.toml), matchers are Python registered by decorator."""
from ampaudit.rules.loader import Rule, load_rules

__all__ = ["Rule", "load_rules"]
