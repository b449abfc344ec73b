// Fixture for check_layers.py: the lowest layer reaching up.
#include "kvsnap/prefix_cache.h"
