#include "kvsnap/cache.h"

namespace kvsnap {

Snapshot::~Snapshot() = default;
Cache::~Cache() = default;

}  // namespace kvsnap
