// Fixture for check_layers.py: another layer's private header.
#include "cache/kv_store.h"
#include "cache/snapshot_record.h"
