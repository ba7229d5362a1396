// The TransferEngine over its NICs (transport.h: libfabric domains or verbs
// NICs): peers, peer groups (prebuilt work-request templates) and the
// operations, which validate on the calling thread and submit work requests
// to the worker of the chosen domain (posted from the calling thread when its
// endpoints are free, see worker.h). Waiters (Transfer::wait, wait_imm) drive
// progress themselves through a ProgressHook before sleeping.
#include "moelink/transfer_engine.h"

#include <rdma/fabric.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <unordered_map>
#include <mutex>

#include "fabric/block_cache.h"
#include "fabric/engine_factory.h"
#include "fabric/fabric_domain.h"
#include "fabric/imm_counters.h"
#include "fabric/memory_registry.h"
#include "fabric/op_state.h"
#include "fabric/worker.h"
#if MOELINK_WITH_VERBS
#include "fabric/verbs/verbs_engine.h"
#endif

namespace moelink::fabric {

namespace {

// An operation's name (ProgressHook::name): stable while any op lives.
using Text = const std::string*;

struct Peer {
  EngineAddress address;
  std::vector<uint64_t> dest;  // per local domain: Nic::insert_peer's handle
  // The operations' names in error messages, built once.
  Text write_what, paged_what, send_what;
  // Known unreachable? Every work request to the peer points to it, so it
  // is held apart: it stays put while the Peer is moved into the deque.
  std::unique_ptr<PeerHealth> health;
};

// Peers are looked up by address on every write: hash the address in place
// instead of serializing it.
struct AddressHash {
  size_t operator()(const EngineAddress& a) const {
    size_t h = std::hash<std::string>()(a.name);
    for (const auto& e : a.endpoints) h = h * 1000003u ^ std::hash<std::string>()(e);
    return h;
  }
};

// A group member's template: everything of its work request but the local
// buffer, the length, the remote offset and the immediate.
struct Member {
  PeerId peer = 0;
  WorkRequest tmpl;
  uint64_t size = 0;
};

struct Group {
  std::vector<Member> members;
  Text scatter_what, barrier_what;
};

uint64_t next_engine_serial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// The work requests of one call, per worker, reused from call to call so
// that posting allocates nothing once warm (one set per calling thread).
std::vector<std::vector<WorkRequest>>& scratch(size_t domains) {
  thread_local std::vector<std::vector<WorkRequest>> s;
  if (s.size() < domains) s.resize(domains);
  return s;
}

class FabricEngine final : public TransferEngine {
 public:
  // The options were checked (check_options); nics[i] is domain i.
  FabricEngine(const EngineOptions& o, std::vector<std::unique_ptr<Nic>> nics)
      : options_(o), domains_(std::move(nics)) {
    address_.name = o.name;
    for (auto& d : domains_) address_.endpoints.push_back(d->endpoint());
    progress_ = std::make_shared<ProgressHook>(
        [this] {
          Pass found = Pass::kIdle;
          for (auto& w : workers_) {
            const Pass p = w->progress();
            if (p == Pass::kWork || found == Pass::kIdle) found = p;
          }
          return found;
        },
        /*busy=*/!o.yield_when_idle);
    Worker::Options wo{o.yield_when_idle, &progress_->waiters()};
    for (int first = 0; first < o.num_domains; first += o.domains_per_worker) {
      std::vector<Nic*> group;
      for (int i = first; i < std::min(o.num_domains, first + o.domains_per_worker); ++i)
        group.push_back(domains_[i].get());
      if (!o.worker_cpus.empty())
        wo.cpu = o.worker_cpus[workers_.size() % o.worker_cpus.size()];
      workers_.push_back(std::make_unique<Worker>(group, imms_, messages_, wo));
    }
  }

  ~FabricEngine() override {
    progress_->clear();  // operations may outlive the engine
    for (auto& w : workers_) w->stop();
    for (auto& r : registry_.take_all())
      for (size_t i = 0; i < r->mrs.size(); ++i) domains_[i]->deregister_memory(r->mrs[i]);
    for (auto& d : domains_) d->close_endpoint();  // no completions after this
    workers_.clear();                               // frees abandoned contexts
    domains_.clear();
  }

  const EngineAddress& address() const override { return address_; }
  std::string provider() const override { return domains_[0]->provider(); }
  int num_domains() const override { return static_cast<int>(domains_.size()); }
  bool hmem() const override { return domains_[0]->hmem(); }

  MemoryRegion register_memory(void* ptr, size_t size, MemoryKind kind, int device) override {
    if (!ptr || size == 0)
      throw InvalidArgument("TransferEngine register_memory: null pointer or zero size");
    std::vector<MemoryHandle> mrs;
    try {
      for (auto& d : domains_) {
        MemoryHandle mr;
        worker_of(d->index()).call([&] { mr = d->register_memory(ptr, size, kind, device); });
        mrs.push_back(mr);
      }
    } catch (...) {
      for (size_t i = 0; i < mrs.size(); ++i)
        worker_of(static_cast<int>(i)).call([&] { domains_[i]->deregister_memory(mrs[i]); });
      throw;
    }
    return MemoryRegion{registry_.add(ptr, size, std::move(mrs)), ptr, size};
  }

  void deregister_memory(const MemoryRegion& region) override {
    auto r = registry_.remove(region.id, "deregister_memory");
    for (size_t i = 0; i < r->mrs.size(); ++i)
      worker_of(static_cast<int>(i)).call([&] { domains_[i]->deregister_memory(r->mrs[i]); });
  }

  MemoryDescriptor descriptor(const MemoryRegion& region) const override {
    const Registration& r = registry_.check(region, 0, 0, "descriptor");
    MemoryDescriptor d;
    d.owner = address_;
    d.size = r.size;
    for (size_t i = 0; i < domains_.size(); ++i) {
      d.remote_base.push_back(r.mrs[i].remote_base);
      d.keys.push_back(r.mrs[i].key);
    }
    return d;
  }

  // Added again on purpose, a peer known unreachable is tried again: its
  // next operation goes to the provider, which may have reconnected.
  PeerId add_peer(const EngineAddress& address) override {
    return find_or_add_peer(address, /*revive=*/true);
  }

  // revive: clear the peer's unreachable mark (PeerHealth). Descriptors and
  // peer groups add their peers without: only add_peer says one may be back.
  PeerId find_or_add_peer(const EngineAddress& address, bool revive) {
    if (address.endpoints.empty())
      throw InvalidArgument("TransferEngine add_peer: address of '" + address.name +
                            "' has no endpoints");
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto known = [&](PeerId id) {
      if (revive) peers_[id].health->clear();
      return last_peer_ = id;
    };
    // Writes usually go to the peer of the last one: compare before hashing.
    if (last_peer_ >= 0 && peers_[last_peer_].address == address) return known(last_peer_);
    auto it = peer_ids_.find(address);
    if (it != peer_ids_.end()) return known(it->second);
    Peer p;
    p.address = address;
    for (auto& d : domains_) {
      // Local domain i talks to the peer's domain i (mod its count).
      const auto& endpoint = address.endpoints[d->index() % address.endpoints.size()];
      uint64_t dest = 0;
      worker_of(d->index()).call([&] { dest = d->insert_peer(endpoint, address.name); });
      p.dest.push_back(dest);
    }
    const PeerId id = static_cast<PeerId>(peers_.size());
    const std::string who = "peer '" + address.name + "' (peer " + std::to_string(id) + ")";
    p.write_what = progress_->name("write to " + who);
    p.paged_what = progress_->name("paged_write to " + who);
    p.send_what = progress_->name("send to " + who);
    p.health = std::make_unique<PeerHealth>(who);
    peers_.push_back(std::move(p));
    peer_ids_.emplace(address, id);
    return last_peer_ = id;
  }

  GroupId add_peer_group(const std::vector<MemoryDescriptor>& members) override {
    if (members.empty()) throw InvalidArgument("TransferEngine add_peer_group: no members");
    Group group;
    for (size_t i = 0; i < members.size(); ++i) {
      const PeerId peer = find_or_add_peer(members[i].owner, /*revive=*/false);
      Nic* d = domains_[i % domains_.size()].get();
      group.members.push_back(Member{peer, make_template(peer, d, members[i], "add_peer_group"),
                                     members[i].size});
    }
    std::lock_guard<std::mutex> lock(peers_mu_);
    const auto id = static_cast<GroupId>(groups_.size());
    group.scatter_what = progress_->name("scatter (group " + std::to_string(id) + ")");
    group.barrier_what = progress_->name("barrier (group " + std::to_string(id) + ")");
    groups_.push_back(std::move(group));
    return id;
  }

  TransferPtr write(const MemoryRegion& src, uint64_t src_offset, const MemoryDescriptor& dst,
                    uint64_t dst_offset, size_t len, std::optional<uint32_t> imm,
                    Callback cb) override {
    const Route r = route(dst.owner, &Peer::write_what);
    const Text& what = *r.what;
    const Registration& reg = registry_.check(src, src_offset, len, *what);
    if (!in_range(dst.size, dst_offset, len))
      check_range(dst.size, dst_offset, len, *what, "destination");
    WorkRequest wr = write_template(r, dst, *what);
    fill(wr, reg, r.nic, src_offset, dst_offset, len, imm);
    std::shared_ptr<OpState> op;
    auto make = [&] { return new_op(what, 1, std::move(cb)); };
    worker_of(r.nic->index()).submit_one(wr, op, OpMaker(make));
    return op;
  }

  TransferPtr paged_write(const MemoryRegion& src, const MemoryDescriptor& dst,
                          const PagedWrite& p, std::optional<uint32_t> imm, Callback cb) override {
    const Route r = route(dst.owner, &Peer::paged_what);
    const Text& what_text = *r.what;
    const std::string& what = *what_text;
    if (p.src_pages.size() != p.dst_pages.size())
      throw InvalidArgument("TransferEngine " + what + ": " + std::to_string(p.src_pages.size()) +
                            " source pages but " + std::to_string(p.dst_pages.size()) +
                            " destination pages");
    const Registration& reg = registry_.check(src, 0, 0, what);
    auto& per_domain = scratch(domains_.size());
    // One template per domain used (pages are sharded across domains),
    // built at the domain's first page as before (same error order).
    thread_local std::vector<WorkRequest> tmpl;  // reused: no allocation once warm
    tmpl.clear();
    struct Unsubmitted {  // a page that fails its check leaves nothing queued
      std::vector<std::vector<WorkRequest>>& v;
      ~Unsubmitted() {
        for (auto& w : v) w.clear();
      }
    } unsubmitted{per_domain};
    for (size_t i = 0; i < p.src_pages.size(); ++i) {
      const uint64_t so = p.src_offset + p.src_pages[i] * p.src_stride;
      const uint64_t dof = p.dst_offset + p.dst_pages[i] * p.dst_stride;
      if (!in_range(reg.size, so, p.page_bytes) || !in_range(dst.size, dof, p.page_bytes)) {
        const std::string page = what + " (page " + std::to_string(i) + ")";
        check_range(reg.size, so, p.page_bytes, page, "source");
        check_range(dst.size, dof, p.page_bytes, page, "destination");
      }
      // Pages are sharded across domains (NICs).
      const size_t di = i % domains_.size();
      Nic* d = domains_[di].get();
      if (di == tmpl.size())
        tmpl.push_back(write_template(Route{r.peer, r.p, nullptr, d, r.p->dest[di]}, dst, what));
      per_domain[di].push_back(tmpl[di]);
      fill(per_domain[di].back(), reg, d, so, dof, p.page_bytes, imm);
    }
    auto make = [&] {
      return new_op(what_text, static_cast<int>(std::max<size_t>(1, p.src_pages.size())),
                    std::move(cb));
    };
    auto op = submit_all(per_domain, OpMaker(make));
    if (p.src_pages.empty()) op->complete_one();
    return op;
  }

  TransferPtr scatter(GroupId group, const MemoryRegion& src,
                      const std::vector<ScatterSlice>& slices, uint32_t imm, Callback cb) override {
    const Group& g = group_at(group, "scatter");
    const std::vector<Member>& members = g.members;
    const std::string& what = *g.scatter_what;
    const Registration& reg = registry_.check(src, 0, 0, what);
    auto& per_domain = scratch(domains_.size());
    struct Unsubmitted {  // a slice that fails its check leaves nothing queued
      std::vector<std::vector<WorkRequest>>& v;
      ~Unsubmitted() {
        for (auto& w : v) w.clear();
      }
    } unsubmitted{per_domain};
    for (const auto& s : slices) {
      if (s.member >= members.size())
        throw InvalidArgument("TransferEngine " + what + ": member " + std::to_string(s.member) +
                              " of a " + std::to_string(members.size()) + "-member group");
      const Member& m = members[s.member];
      if (!in_range(reg.size, s.src_offset, s.len) || !in_range(m.size, s.dst_offset, s.len)) {
        const std::string w = "scatter to " + peer_str(m.peer);
        check_range(reg.size, s.src_offset, s.len, w, "source");
        check_range(m.size, s.dst_offset, s.len, w, "destination");
      }
      auto& wrs = per_domain[m.tmpl.nic->index()];
      wrs.push_back(m.tmpl);
      fill(wrs.back(), reg, m.tmpl.nic, s.src_offset, s.dst_offset, s.len, imm);
    }
    auto make = [&] {
      return new_op(g.scatter_what, static_cast<int>(std::max<size_t>(1, slices.size())),
                    std::move(cb));
    };
    auto op = submit_all(per_domain, OpMaker(make));
    if (slices.empty()) op->complete_one();
    return op;
  }

  TransferPtr barrier(GroupId group, uint32_t imm, Callback cb) override {
    const Group& g = group_at(group, "barrier");
    auto& per_domain = scratch(domains_.size());
    for (const Member& m : g.members) {
      auto& wrs = per_domain[m.tmpl.nic->index()];
      wrs.push_back(m.tmpl);  // zero bytes, no local buffer
      wrs.back().has_imm = true;
      wrs.back().imm = imm;
    }
    auto make = [&] {
      return new_op(g.barrier_what, static_cast<int>(g.members.size()), std::move(cb));
    };
    return submit_all(per_domain, OpMaker(make));
  }

  void wait_imm(uint32_t imm, uint64_t count, double timeout_s) override {
    imms_.wait(imm, count, timeout_s < 0 ? options_.timeout_s : timeout_s, progress_.get());
  }
  uint64_t imm_count(uint32_t imm) const override { return imms_.get(imm); }

  void signal_on_imm(uint32_t imm, uint64_t count, uint64_t* flag, uint64_t value) override {
    const std::string what = "TransferEngine signal_on_imm (immediate " + std::to_string(imm) + ")";
    if (!flag) throw InvalidArgument(what + ": flag is null");
    if (reinterpret_cast<uintptr_t>(flag) % alignof(uint64_t) != 0)
      throw InvalidArgument(what + ": flag " + std::to_string(reinterpret_cast<uintptr_t>(flag)) +
                            " is not 8-byte aligned");
    if (count == 0) throw InvalidArgument(what + ": count is 0 (must be >= 1)");
    imms_.signal(imm, count, flag, value);
  }

  TransferPtr send(PeerId peer, const MemoryRegion& src, uint64_t offset, size_t len,
                   Callback cb) override {
    const Text what = peer_text(peer, &Peer::send_what);  // throws for unknown peers
    const Registration& reg = registry_.check(src, offset, len, *what);
    if (len > options_.max_message_bytes)
      throw InvalidArgument("TransferEngine " + *what + ": " + std::to_string(len) +
                            " bytes exceed max_message_bytes " +
                            std::to_string(options_.max_message_bytes));
    Nic* d = domains_[static_cast<size_t>(peer) % domains_.size()].get();
    const Peer& p = peer_at(peer);
    WorkRequest wr;
    wr.kind = Wr::Kind::kSend;
    wr.nic = d;
    wr.dest = p.dest[d->index()];
    wr.peer = p.health.get();
    wr.buf = static_cast<char*>(reg.ptr) + offset;
    wr.len = len;
    wr.desc = reg.mrs[d->index()].desc;
    std::shared_ptr<OpState> op;
    auto make = [&] { return new_op(what, 1, std::move(cb)); };
    worker_of(d->index()).submit_one(wr, op, OpMaker(make));
    return op;
  }

  std::optional<Message> recv(double timeout_s) override { return messages_.pop(timeout_s); }

 private:
  Worker& worker_of(int domain) { return *workers_[domain / options_.domains_per_worker]; }

  // A write's peer, its operation name and its NIC (domain peer % domains)
  // with the destination handle there, in one lock when the peer is known.
  // `what` points into peers_ (a deque: entries never move or go away).
  struct Route {
    PeerId peer;
    const Peer* p;
    const Text* what;
    Nic* nic;
    uint64_t dest;
  };
  Route route(const EngineAddress& address, Text Peer::*which) {
    const Peer* p = nullptr;
    PeerId id = -1;
    // The peer this thread wrote to last on this engine: Peer entries never
    // change once added and never move (a deque), so no lock is needed.
    thread_local struct {
      uint64_t engine = 0;
      const Peer* peer = nullptr;
      PeerId id = -1;
    } last;
    if (last.engine == serial_ && last.peer->address == address) {
      p = last.peer;
      id = last.id;
    } else {
      for (int attempt = 0; !p; ++attempt) {
        {
          std::lock_guard<std::mutex> lock(peers_mu_);
          if (last_peer_ >= 0 && peers_[last_peer_].address == address) {
            id = last_peer_;
          } else if (auto it = peer_ids_.find(address); it != peer_ids_.end()) {
            id = last_peer_ = it->second;
          }
          if (id >= 0) p = &peers_[id];
        }
        if (p) break;
        if (attempt > 0) throw FabricError("TransferEngine: peer '" + address.name + "' vanished");
        find_or_add_peer(address, /*revive=*/false);  // a new peer: the slow path, then look again
      }
      last = {serial_, p, id};
    }
    Nic* d = domains_[index_mod(static_cast<size_t>(id), domains_.size())].get();
    return Route{id, p, &(p->*which), d, p->dest[d->index()]};
  }
  // A write template for a route (make_template without another lookup).
  WorkRequest write_template(const Route& r, const MemoryDescriptor& dst, const std::string& what) {
    if (dst.keys.size() != dst.owner.endpoints.size() || dst.keys.size() != dst.remote_base.size())
      throw InvalidArgument("TransferEngine " + what + ": malformed descriptor");
    const size_t rd = index_mod(static_cast<size_t>(r.nic->index()), dst.keys.size());
    WorkRequest wr;
    wr.kind = Wr::Kind::kWrite;
    wr.nic = r.nic;
    wr.dest = r.dest;
    wr.peer = r.p->health.get();
    wr.remote_addr = dst.remote_base[rd];
    wr.remote_key = dst.keys[rd];
    return wr;
  }

  // One of the peer's operation names; InvalidArgument for an unknown peer.
  Text peer_text(PeerId peer, Text Peer::*which) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      throw InvalidArgument("TransferEngine: unknown peer " + std::to_string(peer) + " (" +
                            std::to_string(peers_.size()) + " peers added)");
    return peers_[peer].*which;
  }
  std::string peer_str(PeerId peer) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    return "peer '" + peers_[peer].address.name + "' (peer " + std::to_string(peer) + ")";
  }

  // A known peer's entry: it never moves nor goes away (a deque).
  const Peer& peer_at(PeerId peer) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    return peers_[peer];
  }

  const Group& group_at(GroupId g, const char* op) {
    // The group this thread used last on this engine, without the lock
    // (a scatter and its barrier go to one group): groups never change
    // once added and never move (a deque).
    thread_local struct {
      uint64_t engine = 0;
      GroupId id = -1;
      const Group* group = nullptr;
    } last;
    if (last.engine == serial_ && last.id == g) return *last.group;
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (g < 0 || static_cast<size_t>(g) >= groups_.size())
      throw InvalidArgument(std::string("TransferEngine ") + op + ": unknown peer group " +
                            std::to_string(g));
    last = {serial_, g, &groups_[g]};
    return groups_[g];  // a deque: references stay valid
  }

  // The write template for (peer, local domain d, destination descriptor).
  WorkRequest make_template(PeerId peer, Nic* d, const MemoryDescriptor& dst,
                            const std::string& what) {
    const Peer& p = peer_at(peer);
    return write_template(Route{peer, &p, nullptr, d, p.dest[d->index()]}, dst, what);
  }

  // i % n without a division in the common one-domain case (a division
  // is tens of cycles on the way of every write).
  static size_t index_mod(size_t i, size_t n) { return n == 1 ? 0 : i % n; }

  static bool in_range(uint64_t size, uint64_t offset, uint64_t len) {
    return offset <= size && len <= size - offset;
  }

  static void fill(WorkRequest& wr, const Registration& reg, const Nic* d, uint64_t src_offset,
                   uint64_t dst_offset, size_t len, std::optional<uint32_t> imm) {
    wr.buf = static_cast<char*>(reg.ptr) + src_offset;
    wr.len = len;
    wr.desc = reg.mrs[d->index()].desc;
    wr.remote_addr += dst_offset;
    wr.has_imm = imm.has_value();
    wr.imm = imm.value_or(0);
  }

  std::shared_ptr<OpState> new_op(const Text& what, int wrs, Callback cb) {
    auto op = std::allocate_shared<OpState>(CachedAllocator<OpState>(), what, wrs,
                                            coarse_now() + timeout_, std::move(cb), progress_);
    return op;
  }

  // The operation is made in the first submission (after its direct
  // posts), or here when there is no work request at all.
  std::shared_ptr<OpState> submit_all(std::vector<std::vector<WorkRequest>>& per_domain,
                                      OpMaker make) {
    std::shared_ptr<OpState> op;
    for (size_t i = 0; i < domains_.size(); ++i)
      if (!per_domain[i].empty()) worker_of(static_cast<int>(i)).submit(per_domain[i], op, make);
    return op ? op : make();
  }

  EngineOptions options_;
  // Unique across engines (a thread's cached route names its engine by it).
  const uint64_t serial_ = next_engine_serial();
  // options_.timeout_s as the clock's duration (converted once, not per op).
  const Clock::duration timeout_ = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.timeout_s));
  std::vector<std::unique_ptr<Nic>> domains_;  // one per domain (NIC)
  EngineAddress address_;
  ImmCounters imms_;
  MessageQueue messages_;
  MemoryRegistry registry_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex peers_mu_;
  std::deque<Peer> peers_;  // references stay valid as peers are added
  PeerId last_peer_ = -1;  // under peers_mu_: the peer add_peer found last
  std::unordered_map<EngineAddress, PeerId, AddressHash> peer_ids_;
  std::shared_ptr<ProgressHook> progress_;
  std::deque<Group> groups_;
};

// InvalidArgument for options no transport accepts, before any NIC is opened.
void check_options(const EngineOptions& o) {
  if (o.num_domains < 1 || o.num_domains > 64)
    throw InvalidArgument("TransferEngine: num_domains " + std::to_string(o.num_domains) +
                          " is outside 1..64");
  if (o.domains_per_worker < 1)
    throw InvalidArgument("TransferEngine: domains_per_worker must be >= 1");
  if (o.timeout_s <= 0) throw InvalidArgument("TransferEngine: timeout_s must be > 0");
  if (o.recv_buffers < 1 || o.max_message_bytes < 1)
    throw InvalidArgument("TransferEngine: recv_buffers and max_message_bytes must be >= 1");
  // Only the range is checked here: the calling thread may itself be
  // pinned elsewhere, and whether a CPU is in the process's cpuset shows
  // when the worker is pinned (Worker).
  const long configured = sysconf(_SC_NPROCESSORS_CONF);
  const int cpus = static_cast<int>(std::min<long>(configured > 0 ? configured : 1, CPU_SETSIZE));
  for (size_t i = 0; i < o.worker_cpus.size(); ++i)
    if (o.worker_cpus[i] < 0 || o.worker_cpus[i] >= cpus)
      throw InvalidArgument("TransferEngine: worker_cpus[" + std::to_string(i) + "] = " +
                            std::to_string(o.worker_cpus[i]) + " is outside 0.." +
                            std::to_string(cpus - 1) + " (this machine's CPUs)");
}

}  // namespace

std::unique_ptr<TransferEngine> create_engine_on(const EngineOptions& options,
                                                 const NicFactory& make_nic) {
  check_options(options);
  std::vector<std::unique_ptr<Nic>> nics;
  for (int i = 0; i < options.num_domains; ++i) nics.push_back(make_nic(i));
  return std::make_unique<FabricEngine>(options, std::move(nics));
}

std::unique_ptr<TransferEngine> TransferEngine::create(const EngineOptions& options) {
  check_options(options);
  if (options.provider == kVerbsProvider) {
#if MOELINK_WITH_VERBS
    return create_engine_on(options, verbs::ibv_nic_factory(options));
#else
    throw ProviderUnavailable(
        "TransferEngine: provider 'ibverbs' (moelink's libibverbs transport) is not built in: "
        "libibverbs was not found when moelink was configured (pkg-config libibverbs)");
#endif
  }
  const std::shared_ptr<ProviderInfo> info = query_provider(options.provider);
  const ReceiveConfig rx{options.max_message_bytes, options.recv_buffers};
  return create_engine_on(options, [&](int i) -> std::unique_ptr<Nic> {
    return std::make_unique<Domain>(info->domains[static_cast<size_t>(i) % info->domains.size()],
                                    i, rx);
  });
}

std::string fabric_runtime_version() {
  const uint32_t v = fi_version();
  return std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v));
}

bool provider_available(const std::string& provider) {
  if (provider == kVerbsProvider) {
#if MOELINK_WITH_VERBS
    return verbs::ibv_devices_present();
#else
    return false;
#endif
  }
  try {
    query_provider(provider);
    return true;
  } catch (const ProviderUnavailable&) {
    return false;
  }
}

}  // namespace moelink::fabric
