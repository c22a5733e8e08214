"""The ingress replica's read copy of the aggregators' records: one mirror per engine, the fleet view
over them, the fleet's merged metrics."""
