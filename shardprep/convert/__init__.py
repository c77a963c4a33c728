"""Moving bytes: read the source checkpoints, execute a plan into rank files under a
journal and a lock, write the manifest last, and verify an artifact."""
