-- 0022_admitted_objects: the Kubernetes objects the admission webhook let through on a decision
-- (their own ALLOW, or as the child of such an object). A Pod, Job or RayCluster naming an
-- admitted kind as its controller is let through without a decision only when that owner is
-- here (or is a run admitted under its own UID): an ownerReference is the creator's to write,
-- and one naming a Job that was never decided (a CPU-only Job, one of another name) let GPU
-- pods through unbudgeted.
CREATE TABLE admitted_objects (
    uid         text PRIMARY KEY,
    namespace   text NOT NULL,
    kind        text NOT NULL,
    name        text NOT NULL,
    run_id      text NOT NULL,
    admitted_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX admitted_objects_admitted_at ON admitted_objects (admitted_at);
