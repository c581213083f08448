"""HTTP request and response models, one module per resource, named by role
(`RunCreate`, `RunPublic`, `RunsPublic`): `wire` (the ingest batch), `runs`, `webhooks`,
`advisor`, `alerts`, `errors`."""
