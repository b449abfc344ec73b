// kvsnap — snapshot, rewind, branch and reuse the inference state of language models.
//
// The umbrella header: includes every public kvsnap header. See README.md for a tour.
#pragma once

#include "kvsnap/allocator.h"
#include "kvsnap/array.h"
#include "kvsnap/attention.h"
#include "kvsnap/batch.h"
#include "kvsnap/cache.h"
#include "kvsnap/dlpack.h"
#include "kvsnap/dtype.h"
#include "kvsnap/error.h"
#include "kvsnap/kv_cache.h"
#include "kvsnap/ops.h"
#include "kvsnap/paged_kv_cache.h"
#include "kvsnap/persistence.h"
#include "kvsnap/prefix_cache.h"
#include "kvsnap/recurrent_cache.h"
#include "kvsnap/rotating_kv_cache.h"
#include "kvsnap/shape.h"
#include "kvsnap/speculation.h"
#include "kvsnap/tier.h"
