"""The local stack behind `budgetgate dev`: Postgres, Redis and Kafka on this machine, no Docker.

`stack` brings a checkout's stack up and down; `postgres`, `redis` and `kafka` run the servers
shipped in wheels (also used by the test fixtures); `services` lists the budgetgate services;
`state` is the `.budgetgate/dev.json` file that other commands read their settings from.
"""
