#include "tier/host_resolver.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

namespace kvsnap::detail {
namespace {

// getaddrinfo's numeric addresses for `host`: IPv4 ones, else IPv6 ones (hiredis's order: trying
// IPv6 first would cost every connect a timeout where it is not routed).
std::vector<std::string> system_resolve(const std::string& host) {
  std::vector<std::string> out;
  std::string why;
  for (const int family : {AF_INET, AF_INET6}) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int error = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); error != 0) {
      why = error == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(error);
      continue;
    }
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char text[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) ==
              0 &&
          std::find(out.begin(), out.end(), text) == out.end()) {
        out.emplace_back(text);
      }
    }
    ::freeaddrinfo(found);
    if (!out.empty()) return out;
  }
  throw std::runtime_error(why.empty() ? "no address" : why);
}

bool numeric_host(const std::string& host) {
  in6_addr address{};
  return ::inet_pton(AF_INET, host.c_str(), &address) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &address) == 1;
}

}  // namespace

struct HostResolver::Resolution {
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  std::vector<std::string> addresses;
  std::string error;
};

HostResolver::HostResolver(std::string host, Resolve resolve, bool patient)
    : host_(std::move(host)),
      resolve_(resolve ? std::move(resolve) : system_resolve),
      patient_(patient) {}

std::vector<std::string> HostResolver::addresses(Deadline deadline) {
  if (numeric_host(host_)) return {host_};
  if (!resolved_.empty()) return resolved_;
  const bool starting = running_ == nullptr;
  if (starting) {
    auto resolution = std::make_shared<Resolution>();
    try {
      std::thread([resolution, resolve = resolve_, host = host_] {
        std::vector<std::string> addresses;
        std::string error;
        try {
          addresses = resolve(host);
          if (addresses.empty()) error = "no address";
        } catch (const std::exception& e) {
          error = e.what();
        } catch (...) {
          error = "the resolver failed";
        }
        const std::lock_guard lock(resolution->mutex);
        resolution->addresses = std::move(addresses);
        resolution->error = std::move(error);
        resolution->done = true;
        resolution->finished.notify_all();
      }).detach();
    } catch (const std::system_error& e) {
      throw ResolveError(fmt::format("cannot start resolving {} ({})", host_, e.what()));
    }
    running_ = std::move(resolution);
  }
  // The call that started the resolution waits for it until its deadline; later calls do not
  // wait at all while it runs (unless patient): a DNS server that does not answer costs one
  // deadline, not every lookup's. Neither is a failure of the store: nothing is known to be
  // wrong with it yet.
  const bool waits = starting || patient_;
  std::unique_lock lock(running_->mutex);
  if (!running_->finished.wait_until(lock, waits ? deadline : std::chrono::steady_clock::now(),
                                     [this] { return running_->done; })) {
    throw StoreFailure(fmt::format("{} is still being resolved", host_),
                       waits ? StoreFailure::Reason::timed_out : StoreFailure::Reason::waiting);
  }
  std::vector<std::string> addresses = std::move(running_->addresses);
  const std::string error = std::move(running_->error);
  lock.unlock();
  running_.reset();
  if (!error.empty()) throw ResolveError(fmt::format("cannot resolve {} ({})", host_, error));
  resolved_ = addresses;
  return addresses;
}

}  // namespace kvsnap::detail
