// Internal: a Redis host name's numeric addresses, resolved on a thread of their own.
// getaddrinfo takes no deadline: a DNS server that does not answer would hold the caller (and the
// tier's lookup connection) for the resolver's timeouts, seconds.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tier/store.h"

namespace kvsnap::detail {

// A name that did not resolve: why, as the resolver said.
struct ResolveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class HostResolver {
 public:
  // Numeric addresses of a host name (IPv4 before IPv6); throws std::exception saying why there
  // are none.
  using Resolve = std::function<std::vector<std::string>(const std::string& host)>;

  // `resolve` null: getaddrinfo. `patient`: every call waits for a running resolution.
  HostResolver(std::string host, Resolve resolve, bool patient = false);

  // The addresses to try: a numeric host itself; else the last resolution's until forget();
  // else a new resolution's. The call that starts a resolution waits for it until `deadline`,
  // then throws StoreFailure (timed_out); a call while it runs does not wait (StoreFailure,
  // waiting) unless the resolver is patient (then it waits as the first did). Throws
  // ResolveError when the name does not resolve.
  std::vector<std::string> addresses(Deadline deadline);
  // None of the addresses connected: the next call resolves the name afresh (it may have moved).
  void forget() { resolved_.clear(); }

 private:
  struct Resolution;
  std::string host_;
  Resolve resolve_;
  bool patient_;
  std::shared_ptr<Resolution> running_;  // shared with the thread resolving
  std::vector<std::string> resolved_;
};

}  // namespace kvsnap::detail
