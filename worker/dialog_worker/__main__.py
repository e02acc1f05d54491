from dialog_worker.cli import main

raise SystemExit(main())
