"""What made each result (manifests), where results live (layout), and which may share a table
(settings_check). Analysis imports this package without the workflow's glue."""
