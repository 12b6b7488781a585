"""OOT_MIGRATED: the OOT_LEGACY backend after the migration to the split KV-cache write."""
