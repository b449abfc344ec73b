// Tier tests: a slow network in front of a real store — a loopback relay that passes what a
// client sends at once and what the server answers one byte every `delay`, as a congested link
// or an overloaded server would. The store behind it is the real one; nothing is answered for it.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.h"

namespace kvsnap::testing {

class SlowLink {
 public:
  SlowLink(int server_port, std::chrono::milliseconds delay)
      : server_port_(server_port), delay_(delay) {
    const LoopbackListener listener = listen_on_loopback("SlowLink");
    listener_ = listener.fd;
    port_ = listener.port;
    thread_ = std::thread([this] { run(); });
  }
  ~SlowLink() {
    stopping_ = true;
    thread_.join();
    ::close(listener_);
  }
  SlowLink(const SlowLink&) = delete;
  SlowLink& operator=(const SlowLink&) = delete;

  std::string address() const { return "redis://127.0.0.1:" + std::to_string(port_); }

 private:
  // One thread relays every connection: client bytes at once, server bytes one per delay.
  void run() {
    struct Pair {
      int client, server;
      std::string pending;  // from the server, not yet passed on
    };
    std::vector<Pair> pairs;
    auto next_drip = std::chrono::steady_clock::now();
    while (!stopping_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      for (const Pair& p : pairs) {
        fds.push_back({p.client, POLLIN, 0});
        fds.push_back({p.server, POLLIN, 0});
      }
      ::poll(fds.data(), fds.size(), 5);
      if (fds[0].revents & POLLIN) {
        const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
        const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in address = loopback_address(server_port_);
        if (client >= 0 && server >= 0 &&
            ::connect(server, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
          pairs.push_back({client, server, {}});
          continue;
        }
        if (client >= 0) ::close(client);
        if (server >= 0) ::close(server);
      }
      char buffer[1 << 16];
      for (size_t i = 0; i < pairs.size(); ++i) {
        Pair& p = pairs[i];
        if (fds[1 + 2 * i].revents & (POLLIN | POLLHUP)) {
          const ssize_t n = ::read(p.client, buffer, sizeof buffer);
          if (n > 0) (void)::send(p.server, buffer, static_cast<size_t>(n), MSG_NOSIGNAL);
        }
        if (fds[2 + 2 * i].revents & (POLLIN | POLLHUP)) {
          const ssize_t n = ::read(p.server, buffer, sizeof buffer);
          if (n > 0) p.pending.append(buffer, static_cast<size_t>(n));
        }
      }
      if (std::chrono::steady_clock::now() >= next_drip) {
        next_drip = std::chrono::steady_clock::now() + delay_;
        for (Pair& p : pairs) {
          if (p.pending.empty()) continue;
          (void)::send(p.client, p.pending.data(), 1, MSG_NOSIGNAL);  // a closed client: dropped
          p.pending.erase(0, 1);
        }
      }
    }
    for (const Pair& p : pairs) {
      ::close(p.client);
      ::close(p.server);
    }
  }

  int server_port_;
  std::chrono::milliseconds delay_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace kvsnap::testing
