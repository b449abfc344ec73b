// Fixture for check_layers.py: a public header of a low layer including a higher one.
#include "kvsnap/cache.h"
