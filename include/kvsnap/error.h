// kvsnap::Error — the one exception type kvsnap throws for misuse and bad data.
//
// Every message names the call, the values involved and the rule they broke, e.g.
//   "Array::slice: stop 9 out of range [0, 8] for axis 1 of shape [2, 8]".
#pragma once

#include <stdexcept>

#include "kvsnap/export.h"

namespace kvsnap {

// Thrown on contract violations and corrupt input. The object it was thrown from is unchanged
// (strong exception guarantee).
struct KVSNAP_EXPORT Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace kvsnap
