import torch, time, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
from kvcompress.strategies import fitting as F
torch.set_num_threads(1)
H, N, D = 3, 8192, 64
P = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
k = torch.randn(H, N, D, generator=g) * 2; v = torch.randn(H, N, D, generator=g)
q = torch.randn(H, P, D, generator=g)
M = N // 4
cl = torch.randint(0, M, (H, N), generator=g); cl[:, ::3] = -1
rows = H
flat = torch.where(cl >= 0, cl + torch.arange(H).view(H, 1) * M, H * M).reshape(-1)
mem = F._Members(flat, H * M, H * N)
scale = 0.125
def t(f, r=7):
    f(); b = []
    for _ in range(r):
        a = time.thread_time(); f(); b.append(time.thread_time() - a)
    return min(b) * 1e3
def cur():
    q_t = F._scaled_t(q[None], scale)[0]
    s = torch.matmul(k, q_t)
    top = F._max_over_slots(s[None])[0]
    e = s.sub_(top).exp_()
    z = e.sum(1)
    mass = mem.sum(None, e.view(H * N, P))
    ro = F._numerators(e, v)
    a = torch.einsum("hnp,hp->hn", e, z.reciprocal())
    return mass, ro, a
qs = (q * scale).contiguous()
def tr():
    s = torch.matmul(qs, k.transpose(-1, -2))  # [H, P, N]
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)
    ro = torch.matmul(p, v)
    a = p.sum(1)
    return p, ro, a, lse
def tr_mass_csr(p):
    return mem.sum(None, p.transpose(-1, -2).reshape(H * N, P))
print("P", P, "cur", t(cur))
print("tr (no mass)", t(tr))
p = tr()[0]
print(" tr mass via transposed copy+csr", t(lambda: tr_mass_csr(p)))
print(" parts: mm", t(lambda: torch.matmul(qs, k.transpose(-1, -2))))
s = torch.matmul(qs, k.transpose(-1, -2))
print(" lse", t(lambda: torch.logsumexp(s, -1)), "softmax", t(lambda: torch.softmax(s, -1)), "amax", t(lambda: s.amax(-1)))
print(" pv", t(lambda: torch.matmul(p, v)), "colsum", t(lambda: p.sum(1)))
# dense @ sparse CSR^T
try:
    C = torch.sparse_csr_tensor(mem.crow, mem.cols, torch.ones(mem.cols.shape[0]), size=mem.size)
    Ct = C.t().to_sparse_csr()
    pf = p.permute(1, 0, 2).reshape(P, H * N)
    print(" dense@sparse", t(lambda: torch.mm(pf, Ct)))
except Exception as ex:
    print("dense@sparse err", ex)
def blocked(nb):
    Pb = P // nb
    q_t_all = F._scaled_t(q[None], scale)[0]
    outs = []
    a = None
    for j in range(nb):
        q_t = q_t_all[:, :, j * Pb:(j + 1) * Pb].contiguous()
        s = torch.matmul(k, q_t)
        top = F._max_over_slots(s[None])[0]
        e = s.sub_(top).exp_()
        z = e.sum(1)
        mass = mem.sum(None, e.view(H * N, Pb))
        ro = F._numerators(e, v)
        aj = torch.einsum("hnp,hp->hn", e, z.reciprocal())
        a = aj if a is None else a.add_(aj)
        outs.append((mass, ro))
    return outs, a
for nb in (1, 2, 3, 4, 6):
    if P % nb == 0:
        print("blocks", nb, t(lambda: blocked(nb)))
print("cur again", t(cur))
