"""Built-in matchers, one module per rule family; each registers itself with :func:`ampaudit.rules.registry.matcher`."""
