from caffe_compat.cli import main

raise SystemExit(main())
