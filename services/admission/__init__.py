"""Admission: may this workload start? Decides, reserves on every matching budget at once, and answers ALLOW, DENY or DELAY with the figures."""
