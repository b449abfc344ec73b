// Tests: a TCP listener on a free loopback port, for the servers and relays a test plays itself
// (SlowLink, the tier's scripted Redis).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvsnap::testing {

inline sockaddr_in loopback_address(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// A listening socket on 127.0.0.1 and the port the system chose. Throws std::runtime_error
// naming `who` when none can be made.
struct LoopbackListener {
  int fd = -1;
  int port = 0;
};
inline LoopbackListener listen_on_loopback(const std::string& who) {
  LoopbackListener out;
  out.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address = loopback_address(0);
  socklen_t length = sizeof address;
  if (out.fd < 0 || ::bind(out.fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::listen(out.fd, 8) != 0 ||
      ::getsockname(out.fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (out.fd >= 0) ::close(out.fd);
    throw std::runtime_error(who + ": cannot listen on loopback");
  }
  out.port = ntohs(address.sin_port);
  return out;
}

}  // namespace kvsnap::testing
