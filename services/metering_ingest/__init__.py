"""metering-ingest: exporters' samples (Kafka and HTTP) and lifecycle events over HTTP become usage
records and lifecycle facts, durable before they are acknowledged."""
