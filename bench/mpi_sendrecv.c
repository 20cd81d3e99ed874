/* MPI_Send/MPI_Recv ping-pong timed like `dtrain bench sendrecv`: per size, warm-up, then
 * ITERS round trips (rank 0 sends, rank 1 receives and sends the same size back); time is
 * half of rank 0's mean round trip, busbw = algbw. Verifies the last payload each way.
 * Built by bench/sendrecv_peers.sh with mpicc.
 * Usage: mpirun -np 2 mpi_sendrecv MINBYTES MAXBYTES ITERS WARMUP LABEL
 * Prints "LABEL size time_us algbw busbw wrong" per size. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned char pattern(int rank, long i) { return (unsigned char)((rank * 31 + i * 7) & 0xff); }

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 2) {
    if (rank == 0) fprintf(stderr, "mpi_sendrecv: needs exactly 2 ranks\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  long lo = atol(argv[1]), hi = atol(argv[2]);
  int iters = atoi(argv[3]), warmup = atoi(argv[4]);
  const char* label = argv[5];
  int peer = 1 - rank;
  for (long size = lo; size <= hi; size *= 2) {
    unsigned char* out = malloc(size);
    unsigned char* in = malloc(size);
    for (long i = 0; i < size; ++i) out[i] = pattern(rank, i), in[i] = 0;
    double start = 0;
    for (int it = -warmup; it < iters; ++it) {
      if (it == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        start = MPI_Wtime();
      }
      if (rank == 0) {
        MPI_Send(out, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
        MPI_Recv(in, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(in, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(out, (int)size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
      }
      if (it == iters - 1 && rank == 0) {
        double us = (MPI_Wtime() - start) / iters / 2 * 1e6;
        long wrong = 0, peerWrong = 0;
        for (long i = 0; i < size; ++i) wrong += in[i] != pattern(peer, i);
        MPI_Recv(&peerWrong, 1, MPI_LONG, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        double algbw = size / us / 1e3;
        printf("%s %ld %.2f %.3f %.3f %ld\n", label, size, us, algbw, algbw, wrong + peerWrong);
        fflush(stdout);
      } else if (it == iters - 1) {
        long wrong = 0;
        for (long i = 0; i < size; ++i) wrong += in[i] != pattern(peer, i);
        MPI_Send(&wrong, 1, MPI_LONG, peer, 1, MPI_COMM_WORLD);
      }
    }
    free(out);
    free(in);
  }
  MPI_Finalize();
  return 0;
}
