-- 0030_alert_measures: threshold alerts on two measures, named as such (core/thresholds.py):
-- committed (reserved + consumed) and consumed. The alerts sent before were on consumed.
ALTER TABLE budget_alerts
    ADD COLUMN measure text NOT NULL DEFAULT 'consumed' CHECK (measure IN ('committed', 'consumed')),
    DROP CONSTRAINT budget_alerts_pkey,
    ADD PRIMARY KEY (ledger_key, measure, threshold_percent);
